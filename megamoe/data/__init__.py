"""Data side of training: a sentencepiece tokenizer, a corpus that needs no download, token files.

Modules (imported directly, so ``python -m megamoe.data.tokenizer`` does not import itself twice):

- ``tokenizer``: ``train_sentencepiece``, the ``Tokenizer`` wrapper (sentencepiece ``.model`` or HF
  ``tokenizer.json``) and the ``train`` CLI.
- ``corpus``: ``stdlib_corpus_files``, the Python standard library's own sources as a training corpus.
- ``token_dataset``: ``build_token_file`` and ``TokenDataset`` (a memory-mapped flat token file);
  ``token_file_matches`` tells whether a token file on disk is complete and of a given tokenizer (reuse it).
- ``resumable_sampler``: ``ResumableSampler``, the layout-independent, resumable order of samples.
- ``packing``: ``PackingConfig``, ``packed_micro_batch`` and ``MicroBatch``: documents packed in a row,
  with reset position ids and document-causal attention (Megatron's ``--reset-position-ids`` /
  ``--reset-attention-mask``).
"""
