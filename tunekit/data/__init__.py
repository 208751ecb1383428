"""Data: from a file or a dataset name to the batches a step trains on.

- `layouts`: the record layouts tunekit knows, field mapping, chat templates (imports nothing of tunekit).
- `records`: reading JSONL/JSON/parquet/text, a `save_to_disk` folder or a hub dataset, checked record by record.
- `tokenizer`: a tokenizer from the hub or a folder, or a byte-level BPE trained offline and cached.
- `tokens`: offline tokenization with `datasets.map`, masking, the in-the-loop baseline, `preview`.
- `batching`: padding, length grouping, packing, the DataLoader and its knobs.
- `prepared`: where prepared data is kept and checked: the content-keyed cache, the run's copy, its record.

Every public name of these is also `tunekit.data.<name>` (`data.load_records`, `data.Collator`, ...), imported on
first use, so importing one part does not import the others.
"""

from __future__ import annotations

from tunekit.parts import lazy_face

PARTS = ("layouts", "records", "tokenizer", "tokens", "batching", "prepared")
__getattr__, __dir__ = lazy_face(__name__, PARTS)
