"""Planning a rollback on hand-built manifests: when the local version descends from the target,
the deltas between them may be undone (``back``), where every one is of an invertible codec."""

from __future__ import annotations

import pytest
from test_planner import A, manifest

from weightsync.errors import FormatError
from weightsync.sync.plan import plan_pull, plan_segment

# Keyframe 20, deltas 21 and 22, keyframe 23 (carrying deltas from 22), delta 24.
# w: sparse everywhere; s: never changes; a: an ac delta at 21 and in keyframe 23's delta;
# d: a dense delta at 21, keyframe 23 without a delta; r: reshaped at 22 (in full), dense delta in
# 23, unchanged at 24; big: deltas dearer than its full encoding; gone: absent at 22.
R0 = manifest(
    20,
    None,
    {
        A: [
            ("w", 100, "full", 50, "w0"),
            ("s", 40, "full", 20, "s0"),
            ("a", 80, "full", 40, "a0"),
            ("d", 60, "full", 30, "d0"),
            ("r", 60, "full", 30, "r0"),
            ("big", 64, "full", 10, "b0"),
            ("gone", 16, "full", 9, "g0"),
        ]
    },
)
R1 = manifest(
    21,
    20,
    {
        A: [
            ("w", 100, "sparse", 5, "w1"),
            ("s", 40, "same", 0, "s0"),
            ("a", 80, "ac", 4, "a1"),
            ("d", 60, "dense", 6, "d1"),
            ("r", 60, "sparse", 3, "r1"),
            ("big", 64, "sparse", 30, "b1"),
            ("gone", 16, "sparse", 2, "g1"),
        ]
    },
    chain_length=1,
)
R2 = manifest(
    22,
    21,
    {
        A: [
            ("w", 100, "sparse", 6, "w2"),
            ("s", 40, "same", 0, "s0"),
            ("a", 80, "sparse", 4, "a2"),
            ("d", 60, "sparse", 2, "d2"),
            ("r", 40, "full", 20, "r2"),
            ("big", 64, "sparse", 30, "b2"),
        ]
    },
    chain_length=2,
)
R3 = manifest(
    23,
    22,
    {
        A: [
            ("w", 100, "full", 50, "w3", ("sparse", 7)),
            ("s", 40, "full", 20, "s0", ("same", 0)),
            ("a", 80, "full", 40, "a3", ("ac", 5)),
            ("d", 60, "full", 30, "d3"),
            ("r", 40, "full", 20, "r3", ("dense", 2)),
            ("big", 64, "full", 10, "b3", ("sparse", 30)),
            ("gone", 16, "full", 9, "g3"),
        ]
    },
    keyframe=True,
)
R4 = manifest(
    24,
    23,
    {
        A: [
            ("w", 100, "sparse", 8, "w4"),
            ("s", 40, "same", 0, "s0"),
            ("a", 80, "sparse", 3, "a4"),
            ("d", 60, "sparse", 2, "d4"),
            ("r", 40, "same", 0, "r3"),
            ("big", 64, "sparse", 30, "b4"),
            ("gone", 16, "sparse", 1, "g4"),
        ]
    },
    chain_length=1,
)
RS = {m.version: m for m in (R0, R1, R2, R3, R4)}


def chain_to(version: int) -> list:
    """The target's chain from its keyframe (what ``Repo.chain`` gives for a rollback)."""
    start = 23 if version >= 23 else 20
    return [RS[v] for v in range(start, version + 1)]


def describe(plan) -> dict[str, tuple]:
    """name -> (how, ((version, codec, size), ...)); how is copy, local, back or fresh."""
    out = {}
    for fp in plan.files:
        for r in fp.recipes:
            steps = tuple((s.version, s.codec, s.size) for s in r.steps)
            back = [s.backward for s in r.steps]
            assert not any(back) or all(back), "a rollback recipe undoes only"
            how = "fresh" if r.base is None else "back" if any(back) else "local" if steps else "copy"
            out[r.segment.name] = (how, steps)
    return out


CASES = {
    # target, local, expected recipes
    "back by one": (
        21,
        22,
        {
            "w": ("back", ((22, "sparse", 6),)),
            "s": ("copy", ()),
            "a": ("back", ((22, "sparse", 4),)),  # the ac delta is 21's, not undone
            "d": ("back", ((22, "sparse", 2),)),
            "r": ("fresh", ((20, "full", 30), (21, "sparse", 3))),  # other size locally
            "big": ("back", ((22, "sparse", 30),)),  # 30 < 10 + 30
            "gone": ("fresh", ((20, "full", 9), (21, "sparse", 2))),  # not in the local version
        },
    ),
    "back by two, to the keyframe": (
        20,
        22,
        {
            "w": ("back", ((22, "sparse", 6), (21, "sparse", 5))),
            "s": ("copy", ()),
            "a": ("fresh", ((20, "full", 40),)),  # 21's ac delta cannot be undone
            "d": ("back", ((22, "sparse", 2), (21, "dense", 6))),  # dense runs backward too
            "r": ("fresh", ((20, "full", 30),)),
            "big": ("fresh", ((20, "full", 10),)),  # 60 of deltas cost more than its full encoding
            "gone": ("fresh", ((20, "full", 9),)),
        },
    ),
    "back across a keyframe carrying deltas": (
        22,
        24,
        {
            "w": ("back", ((24, "sparse", 8), (23, "sparse", 7))),  # the keyframe's delta, not its full payload
            "s": ("copy", ()),
            "a": ("fresh", ((20, "full", 40), (21, "ac", 4), (22, "sparse", 4))),  # 23's delta is ac
            "d": ("fresh", ((20, "full", 30), (21, "dense", 6), (22, "sparse", 2))),  # 23 carries no delta
            "r": ("back", ((23, "dense", 2),)),  # 24 'same' costs nothing
            "big": ("back", ((24, "sparse", 30), (23, "sparse", 30))),  # 60 < 10 + 30 + 30
        },
    ),
    "back to the keyframe from its child": (
        23,
        24,
        {
            "w": ("back", ((24, "sparse", 8),)),
            "s": ("copy", ()),
            "a": ("back", ((24, "sparse", 3),)),
            "d": ("back", ((24, "sparse", 2),)),
            "r": ("copy", ()),
            "big": ("fresh", ((23, "full", 10),)),
            "gone": ("back", ((24, "sparse", 1),)),
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rollback_table(case):
    target, local, expected = CASES[case]
    chain = chain_to(target)
    ahead = [RS[v] for v in range(target + 1, local + 1)]
    plan = plan_pull(chain, RS[local], ahead=ahead)
    assert describe(plan) == expected
    for fp in plan.files:
        for r in fp.recipes:
            if r.base is not None:
                assert r.base == RS[local].file(A).segment(r.segment.key)
            for step in r.steps:  # each undone delta is the one its version carries against its parent
                if not step.backward:
                    continue
                seg = RS[step.version].file(A).segment(r.segment.key)
                enc = seg.delta if seg.codec == "full" else seg
                assert (enc.codec, enc.payload.xxh3, enc.payload.size) == (step.codec, step.xxh3, step.size)
    used = {rng.chunk.id for fp in plan.files for r in fp.recipes for s in r.steps for rng in s.ranges}
    assert {n.chunk.id for n in plan.chunks} == used
    assert plan.payload_bytes == sum(sz for _, steps in expected.values() for _, _, sz in steps)


@pytest.mark.parametrize("case", list(CASES))
def test_without_the_versions_ahead_a_rollback_plans_from_the_chain(case):
    """Today's plan: no manifests from the target to the local version, nothing undone."""
    target, local, _ = CASES[case]
    plan = plan_pull(chain_to(target), RS[local])
    assert not any(s.backward for fp in plan.files for r in fp.recipes for s in r.steps)
    assert {r.segment.name: r.base is None for fp in plan.files for r in fp.recipes}["w"]


def test_a_rollback_that_undoes_less_is_cheaper_than_from_the_keyframe():
    before = plan_pull(chain_to(21), R2)
    after = plan_pull(chain_to(21), R2, ahead=[R2])
    assert after.payload_bytes < before.payload_bytes


@pytest.mark.parametrize(
    "ahead,local",
    [
        ([22], 24),  # does not end at the local version
        ([22, 24], 24),  # 24 does not follow 22
        ([23, 24], 24),  # 23 does not follow the target (21)
    ],
)
def test_versions_ahead_that_do_not_lead_to_the_local_version_are_refused(ahead, local):
    with pytest.raises(FormatError):
        plan_pull(chain_to(21), RS[local], ahead=[RS[v] for v in ahead])
    seg = R1.file(A).segment(("tensor", "w"))
    with pytest.raises(FormatError):
        plan_segment(chain_to(21), A, seg, RS[local], ahead=[RS[v] for v in ahead])


def test_versions_ahead_without_a_local_version_are_refused():
    with pytest.raises(FormatError):
        plan_pull(chain_to(21), None, ahead=[R2])


def test_a_noted_delta_is_not_undone():
    """Lazy regions (``avoid``): a recipe reading a noted chunk loses to one that reads none."""
    seg = R1.file(A).segment(("tensor", "w"))
    back = plan_segment(chain_to(21), A, seg, R2, ahead=[R2])
    assert [s.backward for s in back.steps] == [True]
    noted = frozenset(rng.chunk.id for rng in back.steps[0].ranges)
    fresh = plan_segment(chain_to(21), A, seg, R2, avoid=noted, ahead=[R2])
    assert fresh.base is None and not any(s.backward for s in fresh.steps)


def test_an_unknown_codec_is_not_undone():
    """A codec this reader does not know (a newer writer's) is taken as not invertible."""
    odd = manifest(22, 21, {A: [("w", 100, "zz", 6, "w2")]}, chain_length=2, validate=False)
    seg = R1.file(A).segment(("tensor", "w"))
    r = plan_segment(chain_to(21), A, seg, odd, ahead=[odd])
    assert r.base is None and not any(s.backward for s in r.steps)


def test_manifests_that_claim_nothing_changed_yet_disagree_are_not_undone():
    """Every delta on the way is 'same' but the checksums differ: no recipe of zero steps from the
    local bytes (which would be refused later); the chain serves."""
    liar = manifest(22, 21, {A: [("w", 100, "same", 0, "w-other")]}, chain_length=2)
    seg = R1.file(A).segment(("tensor", "w"))
    r = plan_segment(chain_to(21), A, seg, liar, ahead=[liar])
    assert r.base is None


def test_a_step_of_another_dtype_on_the_way_is_not_undone():
    """A version whose segment has the same size but another dtype: the deltas would be decoded at
    the target's element width; no ``back`` recipe."""
    from dataclasses import replace

    seg2 = replace(R2.file(A).segment(("tensor", "w")), dtype="I8")
    other = replace(R2, files=(replace(R2.file(A), segments=(seg2,)),))
    seg = R1.file(A).segment(("tensor", "w"))
    r = plan_segment(chain_to(21), A, seg, other, ahead=[other])
    assert r.base is None
