"""Data side of training: tokenizers, the user's documents, token files and Megatron datasets, blending,
held-out data, packing, chat SFT data.

Modules (imported directly, so ``python -m megamoe.data.tokenizer`` does not import itself twice):

- ``tokenizer``: ``train_sentencepiece``, the ``Tokenizer`` wrapper (sentencepiece ``.model`` or HF
  ``tokenizer.json``) and the ``train`` CLI.
- ``corpus``: ``stdlib_corpus_files``, the Python standard library's own sources as a training corpus.
- ``token_dataset``: ``build_token_file`` and ``TokenDataset`` (fixed-length samples of a token source);
  ``token_file_matches`` tells whether a token file on disk is complete and of a given tokenizer (reuse it).
- ``indexed_dataset``: ``MegatronIndexedDataset``, a validated zero-copy reader of Megatron-LM ``.bin/.idx``.
- ``token_source``: ``open_token_source``, a megamoe token file or a Megatron dataset as one flat id array.
- ``sample_dataset``: the ``SampleDataset`` protocol (``len`` + ``batch``) and helpers of composite datasets.
- ``blending``: ``BlendedDataset``, weighted blending by Megatron-LM's rule.
- ``eval_split``: ``split_train_eval`` (seeded random held-out documents), ``ConcatenatedDataset``,
  ``eval_batches`` (per DP rank).
- ``training_data``: ``tokenized_path`` (documents tokenized once, cached) and ``build_train_eval_data``:
  the run's train and eval datasets from ``--data`` / ``--data-weights``, what scripts call.
- ``resumable_sampler``: ``ResumableSampler``, the layout-independent, resumable order of samples.
- ``packing``: ``PackingConfig``, ``packed_micro_batch`` and ``MicroBatch``: documents packed in a row,
  with reset position ids and document-causal attention (Megatron's ``--reset-position-ids`` /
  ``--reset-attention-mask``).
- ``documents``: ``read_documents``, a user's documents from text, JSON Lines or Parquet files.
- ``parallel_encode``: ``DocumentEncoder``, documents tokenized in worker processes, in order.
- ``preprocess``: what ``megamoe preprocess`` runs (:mod:`megamoe.cli.preprocess`): documents
  to a token file; ``preprocess`` is the same as a function.
- chat SFT data (``--data chats.jsonl``): ``chat_records`` (chat JSON Lines records -> conversations,
  checked), ``chat_template`` (a tokenizer's chat template rendered as transformers renders it),
  ``chat_data`` (conversations -> token ids and the assistant mask, by ``{% generation %}`` or prefix
  rendering), ``chat_documents`` (the tokenized documents' file), ``chat_samples`` (packed rows, labels on
  assistant tokens only, truncate/drop), ``chat_training_data`` (the run's chat train and eval datasets).
"""
