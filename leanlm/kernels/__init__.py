"""CPU kernels compiled on first use (see cpu_gemv.py); each module reports is_available()."""
