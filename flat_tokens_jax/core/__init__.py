"""The ground: pure code every layer uses (format, values, limits, URLs, buffers)
and the compiled kernels, which serve the store's memory-mapped reads as well
as the decode.
"""
