"""CPU kernels in C (one function per ISA), built once with the system's C compiler and cached."""
