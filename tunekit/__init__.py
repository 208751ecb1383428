"""tunekit: fine-tune ~7B language models fast on rented GPUs, with every speed-up measured.

One module per concern: `config` (TuneConfig and presets), `data`, `model`, `attention`, `memory`,
`checkpoint`, `train`, `bench`, `doctor`, `cli`, and `notebook` (helpers the course notebooks share).
"""

__version__ = "0.1.0"
