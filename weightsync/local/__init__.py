"""A local folder: the lock of its one writer, its state, the journal that installs a version
atomically, verified reads of the version it holds, and the checkpoint folders publish reads."""
