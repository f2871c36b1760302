from setuptools import find_packages, setup

setup(
    name="megamoe",
    version="0.1.0",
    description="Megatron-style training and inference for Mixture-of-Experts language models",
    python_requires=">=3.10",
    packages=find_packages(include=["parallel_state*", "megamoe*", "checkpoint_tools*"]),
    install_requires=[
        "torch>=2.4",
        "safetensors>=0.4",
        "sentencepiece>=0.2",
        "tqdm>=4.60",
        "numpy>=1.22",
        "xxhash>=3.0",      # checkpoint file checksums (megamoe.checkpoint.checksums)
    ],
    entry_points={"console_scripts": [
        "megamoe = megamoe.cli.main:main",
        # Aliases of `megamoe convert` and `megamoe preprocess`.
        "megamoe-convert = megamoe.cli.convert:main",
        "megamoe-preprocess = megamoe.cli.preprocess:cli",
    ]},
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-timeout>=2",
            "hypothesis>=6",
            "transformers>=5.0",
            # transformers' FineGrainedFP8Config(dequantize=True), the oracle of the block-FP8 import tests
            "accelerate>=1.0",
            "pyarrow>=14",
            "tensorboard>=2.10",
            # the import layers in .importlinter, checked by tests/test_import_contracts.py
            "import-linter>=2.1",
            # the LoRA oracle and PEFT export tests (megamoe.lora), the OpenAI client against `megamoe serve`
            "peft>=0.17",
            "openai>=1.0",
            "fastapi>=0.110",
            "uvicorn>=0.29",
            "jinja2>=3.1",
        ],
        # `megamoe serve`: the OpenAI-compatible HTTP server (megamoe.serving).
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "transformers>=5.0", "jinja2>=3.1"],
        # Chat SFT data (chat templates rendered with jinja2) and PEFT adapter export.
        "finetune": ["jinja2>=3.1", "transformers>=5.0", "peft>=0.17"],
        # Parquet input for `megamoe-preprocess` (megamoe.data.documents).
        "data": ["pyarrow>=14"],
        # HuggingFace configs for `megamoe-convert import-hf / export-hf / verify`.
        "hf": ["transformers>=5.0"],
        # TensorBoard event files of the training metrics (megamoe.training.metric_sinks).
        "tensorboard": ["tensorboard>=2.10"],
        # TransformerEngine: optional FP8 / fused kernels on NVIDIA GPUs.
        # NVIDIA apex is never a dependency (the PyPI "apex" is an unrelated package).
        "te": ["transformer-engine[pytorch]"],
    },
)
