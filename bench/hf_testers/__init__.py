"""Our testers for transformers' own model test suite (bench/hf_suite.py runs them): `families.py` plugs one
family's small configurations into transformers' `ModelTesterMixin`; `plugin.py` fuses every model right after
it is built."""
