"""The megamoe checkpoint format: save, load, the manifest and its digest, integrity (checksums), the layout
planner, side files and the streams that read and write safetensors. The trainer (:mod:`megamoe.training`), HF
conversion (:mod:`megamoe.hf`) and the ``megamoe-convert`` tools (:mod:`checkpoint_tools`) sit on it; it imports
none of them."""
