# One image for every weightsync process: publisher, subscriber, mirror, fleet, gc.
#
#   docker build -t weightsync:0.1.0 .                                # numpy only (default)
#   docker build --build-arg WITH_TORCH=1 -t weightsync:0.1.0-torch .  # adds the [torch] extra
#   docker build --build-arg WITH_TORCH=1 \
#       --build-arg PIP_EXTRA_INDEX_URL=<CPU wheel index> -t weightsync:0.1.0-torch-cpu .
#
#   docker run --rm weightsync:0.1.0 publisher --store s3://bucket/run --watch /checkpoints \
#       --listen 0.0.0.0:8470
#
# Nothing secret is baked in: S3 credentials come from the standard AWS chain at run time
# (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, IRSA, instance roles), the endpoint from
# AWS_ENDPOINT_URL, the API bearer token from WEIGHTSYNC_API_TOKEN or --api-token-file.

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: a virtual environment holding weightsync and its dependencies -----------------------
FROM ${PYTHON_IMAGE} AS build
ARG WITH_TORCH=0
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/weightsync
WORKDIR /src
# .dockerignore lets only the package sources and its metadata through.
# Dependencies first, from pyproject.toml alone (with the [torch] extra when WITH_TORCH is set; the
# base image's Python 3.11+ reads it with tomllib): a source edit does not rebuild this layer.
COPY pyproject.toml ./
RUN set -eu; \
    extra=""; \
    if [ "$WITH_TORCH" = "1" ] || [ "$WITH_TORCH" = "true" ]; then extra="torch"; fi; \
    if [ -z "$PIP_EXTRA_INDEX_URL" ]; then unset PIP_EXTRA_INDEX_URL; fi; \
    /opt/weightsync/bin/python -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + [r for e in sys.argv[1:] for r in p["optional-dependencies"][e]]))' $extra \
        > /tmp/requirements.txt; \
    /opt/weightsync/bin/pip install -r /tmp/requirements.txt; \
    rm /tmp/requirements.txt
# Then the package itself, without touching the dependencies; `pip check` fails the build if the
# layer above no longer satisfies them.
COPY . .
RUN /opt/weightsync/bin/pip install --no-deps . \
 && /opt/weightsync/bin/pip check \
 && /opt/weightsync/bin/weightsync --help >/dev/null
# Compile the numba kernels into the installed package's __pycache__ (minutes of one CPU; --jobs
# spreads the pieces over the builder's cores), so that no start pays it: numba keys the cache on
# the source's path and contents and on the CPU, and the runtime stage below checks that it is
# served from there, read-only, without compiling. On a machine of another kind the kernels compile
# at start and go to NUMBA_CACHE_DIR if that is writable.
RUN /opt/weightsync/bin/python -m weightsync.codec.jit --jobs "$(nproc)"

# --- runtime: the same base image, the virtual environment, an unprivileged user ----------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="weightsync" \
      org.opencontainers.image.description="Cross-region bit-exact weight delta sync over object storage"
RUN groupadd --system --gid 10001 weightsync \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/weightsync --create-home \
        --shell /usr/sbin/nologin weightsync \
 && mkdir -p /checkpoints /weights /var/lib/weightsync/state /var/lib/weightsync/cache \
 && chown -R 10001:10001 /checkpoints /weights /var/lib/weightsync
COPY --from=build /opt/weightsync /opt/weightsync
# State and caches live under /var/lib/weightsync (mount a volume there to keep the publisher's
# head copy across restarts); no .pyc files are written at run time (read-only root file system).
# NUMBA_CACHE_DIR: where kernels compiled at run time are kept (used only where writable: mount a
# volume there, or at /var/lib/weightsync); those compiled at build time are read from the package.
ENV PATH="/opt/weightsync/bin:${PATH}" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    XDG_STATE_HOME=/var/lib/weightsync/state \
    XDG_CACHE_HOME=/var/lib/weightsync/cache \
    NUMBA_CACHE_DIR=/var/lib/weightsync/cache/numba
USER 10001:10001
# As the unprivileged user, with no writable cache directory (as under a read-only root file
# system): the kernels compiled at build time load without compiling, or the build fails.
RUN NUMBA_CACHE_DIR="" XDG_CACHE_HOME=/nonexistent python -m weightsync.codec.jit --require-cached
WORKDIR /home/weightsync
# Default API ports: publisher 8470, subscriber 8471 (the daemons serve HTTP only with --listen).
EXPOSE 8470 8471 8472
# Probes GET /healthz on the URLs in WEIGHTSYNC_HEALTHCHECK_URLS (space separated; default: the
# publisher's, the subscriber's and the mirror's metrics ports, which all serve /healthz) and
# succeeds if any answers 2xx. One-shot
# commands (gc, fleet) exit before the first probe. Kubernetes ignores this and uses its own probes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request\nurls = os.environ.get('WEIGHTSYNC_HEALTHCHECK_URLS') or 'http://127.0.0.1:8470/healthz http://127.0.0.1:8471/healthz http://127.0.0.1:8472/healthz'\nfor url in urls.split():\n    try:\n        urllib.request.urlopen(url, timeout=3).close()\n        sys.exit(0)\n    except OSError:\n        pass\nsys.exit(1)"]
ENTRYPOINT ["weightsync"]
CMD ["--help"]
