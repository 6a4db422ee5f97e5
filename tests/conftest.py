"""Suite-wide set-up, before any test module is imported:

- TIERSERVE_CPU_ISA reaches ATen and oneDNN before torch is first imported;
- without a CUDA device, Triton kernels run under Triton's CPU interpreter: ``TRITON_INTERPRET`` is
  read when a kernel is decorated (when ``kernels.triton_ops`` is first imported, which any test
  module importing the engine does), so it is set here, whichever tests are run.
"""

import os

from worker.cpu_isa import export_isa_env

export_isa_env()

import torch  # noqa: E402  (after the ISA environment is exported)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
