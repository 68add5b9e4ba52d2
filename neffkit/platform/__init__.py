"""Platform glue both the build and the runtime use: host facts (host.py), loading AOTInductor
packages (aoti.py), neffkit's C++ CPU kernel library (cpu_kernels.py, csrc/), and XLA:CPU
(xla_cpu.py)."""
