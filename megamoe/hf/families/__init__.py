"""One module per HF model family: its key map (``ADAPTER``), registered by ``model_type`` in
:mod:`megamoe.hf.adapters`."""
