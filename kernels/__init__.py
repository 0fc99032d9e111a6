"""oscar.kernels: INT2 formats, torch references, Triton kernels, transformers Cache integration."""
