"""What runs: the publisher and subscriber daemons, their configuration and flags, HTTP API,
metrics, swap hooks, A/B slots and pins, and the command line's progress bars."""
