"""tunekit: fine-tune ~7B language models fast on rented GPUs, with every speed-up measured.

One module per concern: `config` (TuneConfig and presets), `data` (records, offline tokenization), `batching`
(padding, grouping, packing, the DataLoader), `model`, `attention`, `loss`, `memory` (checkpointing, offload,
peak memory), `estimate` (the memory estimator), `checkpoint`, `train`, `bench` (timing the step),
`databench` (lesson 1's data measurements), `results` (result files and their provenance), `claims` (the
article's claims judged from results), `doctor`, `cli`, and `notebook` (helpers the course notebooks share).
"""

__version__ = "0.1.0"
