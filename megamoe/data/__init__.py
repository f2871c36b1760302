"""Data side of training: a sentencepiece tokenizer, a corpus that needs no download, token files.

Modules (imported directly, so ``python -m megamoe.data.tokenizer`` does not import itself twice):

- ``tokenizer``: ``train_sentencepiece``, the ``Tokenizer`` wrapper (sentencepiece ``.model`` or HF
  ``tokenizer.json``) and the ``train`` CLI.
- ``corpus``: ``stdlib_corpus_files``, the Python standard library's own sources as a training corpus.
- ``token_dataset``: ``build_token_file`` and ``TokenDataset`` (a memory-mapped flat token file);
  ``token_file_matches`` tells whether a token file on disk is complete and of a given tokenizer (reuse it).
- ``resumable_sampler``: ``ResumableSampler``, the layout-independent, resumable order of samples.
- ``documents``: ``read_documents``, a user's documents from text, JSON Lines or Parquet files.
- ``parallel_encode``: ``DocumentEncoder``, documents tokenized in worker processes, in order.
- ``preprocess``: the ``megamoe-preprocess`` CLI (``python -m megamoe.data.preprocess``): documents
  to a token file; ``preprocess`` is the same as a function.
"""
