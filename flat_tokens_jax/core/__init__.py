"""The ground every layer uses: format, values, limits, URLs, buffers, compiled kernels."""
