"""Suite-wide set-up, before any test module is imported:

- TIERSERVE_CPU_ISA reaches ATen and oneDNN before torch is first imported;
- without a CUDA device, Triton kernels run under Triton's CPU interpreter: ``TRITON_INTERPRET`` is
  read when a kernel is decorated (when ``kernels.triton_ops`` is first imported, which any test
  module importing the engine does), so it is set here, whichever tests are run.

``tiny_tokenizer_dir``: a tiny byte-level BPE tokenizer folder (tokenizer.json + chat template),
trained in milliseconds, for workload and engine tests that need no embedded model.
"""

import json
import os
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from worker.cpu_isa import export_isa_env

export_isa_env()

import torch  # noqa: E402  (after the ISA environment is exported)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 7))) for _ in range(300)]
    corpus = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(400)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
