"""Suite-wide set-up: TIERSERVE_CPU_ISA reaches ATen and oneDNN before any test imports torch."""

from worker.cpu_isa import export_isa_env

export_isa_env()
