"""HuggingFace conversion: the key maps of each model family (:mod:`megamoe.hf.adapters`), import into and export
from the megamoe checkpoint format (:mod:`megamoe.checkpoint`, below it), and the HF config files. The trainer
(fine-tuning from HF, exporting at the end) and the ``megamoe-convert`` tools sit on it."""
