"""bert/'s architecture: data flows one way. Every module has a place in STAGES, and no module imports (at the top
or inside a function) from a later one; the public names stay where users import them."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Earliest first: text -> tokenised corpus -> instances -> packing -> pipeline -> model -> training -> jobs.
STAGES = [
    "bert.common.errors", "bert.common.files", "bert.common.seeds", "bert.common.commands",
    "bert.common.workers",
    "bert.data.text", "bert.data.tokenizer", "bert.data.corpus", "bert.data.instances", "bert.data.masking",
    "bert.data.batch", "bert.data.packing", "bert.data.pipeline",
    "bert.model.config", "bert.model.checkpoint", "bert.model.ops", "bert.model.padding", "bert.model.modeling",
    "bert.train.optim", "bert.train.static", "bert.train.distributed", "bert.train.settings", "bert.train.rundir",
    "bert.train.health", "bert.train.loop", "bert.train.start",
    "bert.tasks.metrics", "bert.tasks.readers", "bert.tasks.task",
    "bert.masks",
    # the drop-in: its computations and records, the encoder runner, one module per family group, the registry,
    # recognising a model's parts, the heads, the fuser, and its public front
    "bert.hf.compute", "bert.hf.records", "bert.hf.code", "bert.hf.known", "bert.hf.encoder",
    "bert.hf.bert", "bert.hf.mpnet", "bert.hf.albert", "bert.hf.rotary", "bert.hf.esm_roformer", "bert.hf.deberta",
    "bert.hf.families", "bert.hf.recognise", "bert.hf.heads", "bert.hf.fuser", "bert.hf",
    "bert.pretrain", "bert.finetune", "bert",
]


def _module(path: Path) -> str:
    """bert/data/text.py: "bert.data.text" (the name in STAGES; it imports as bertfuse.bert.data.text)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(line, imported module, as named in STAGES) for every import of a bert module in the file, a package's
    modules included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bertfuse.bert"):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            module = node.module.removeprefix("bertfuse.")
            for a in node.names:
                full = f"{module}.{a.name}"
                yield node.lineno, full if full in STAGES else module
        elif isinstance(node, ast.ImportFrom) and node.module == "bertfuse" and any(a.name == "bert" for a in node.names):
            yield node.lineno, "bert"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("bertfuse.bert"):
                    yield node.lineno, a.name.removeprefix("bertfuse.")


def test_every_module_has_a_stage_and_imports_only_from_earlier_ones():
    files = sorted((ROOT / "bert").rglob("*.py"))
    modules = {_module(f) for f in files}
    # bert and bert.hf are stages of their own: their __init__ is the public front of what they hold
    packages = {m for m in modules if (ROOT / Path(*m.split("."))).is_dir()} - {"bert", "bert.hf"}
    assert modules - packages == set(STAGES), "STAGES lists every module of bert/"
    for f in files:
        me = _module(f)
        if me in packages:  # a package's __init__ holds a docstring only
            assert not list(_imports(f)), me
            continue
        for line, imported in _imports(f):
            assert imported in STAGES, f"{f}:{line} imports {imported}, which is not a module of bert"
            assert STAGES.index(imported) < STAGES.index(me), f"{f}:{line}: {me} imports the later {imported}"


def test_the_public_names_stay_where_users_import_them():
    import bertfuse
    from bertfuse import bert
    from bertfuse.bert import finetune, hf, pretrain

    for name in ("BertConfig", "BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForSequenceClassification",
                 "BertForTokenClassification", "BertForQuestionAnswering", "load_tokenizer"):
        assert hasattr(bert, name), name
    assert callable(hf.fuse) and callable(hf.unfuse) and callable(hf.fuse_report)
    assert (bertfuse.fuse, bertfuse.unfuse, bertfuse.fuse_report) == (hf.fuse, hf.unfuse, hf.fuse_report)
    assert callable(pretrain.main) and callable(finetune.main)
