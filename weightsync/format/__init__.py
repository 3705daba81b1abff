"""What is stored (docs/FORMAT.md): store keys and limits, the manifest, safetensors headers, chunk
packing, dtypes. Pure: no I/O, no other layer of weightsync below it."""
