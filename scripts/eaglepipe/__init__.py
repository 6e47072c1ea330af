"""eaglepipe: EAGLE-3 draft training pipeline for vLLM targets.

The map: each rule (rules/*.smk) runs one stage module here as ``python -m eaglepipe.<module>``;
a stage never imports another stage (tests/test_layout.py), what stages share lives in library
modules. A stage's setting flags are made from config/config.schema.yaml by ``settings``, which the
rules use to pass the run's config (tests/test_settings.py).

| rule | stage module | libraries it stands on |
| --- | --- | --- |
| build_target | build_target | transformers (GGUF loading), gguf |
| regenerate_responses | regenerate_responses | vLLM (request stream) or transformers generate |
| prepare_data | prepare_data | transformers chat templates, datasets (file forms) |
| vocab_mapping | vocab_mapping | speculators (draft vocabulary rule) |
| extract_hidden_states, extract_parity_hidden_states | extract_hidden_states | vLLM extract_hidden_states + its connector, or transformers; safetensors |
| gather_hidden_states | gather_manifest | |
| train_draft | train_draft | speculators (EAGLE-3 model, losses), torch (DDP) |
| export_draft | export_draft | speculators, safetensors |
| evaluate_offline, evaluate_parity | evaluate | speculators (the draft's forward) |
| benchmark_serving | benchmark_serving | vLLM (LLM engine, spec-decode metrics) |
| model_card | model_card | |
| plot_report, plot_serving | plots | matplotlib |
"""

import os

# CPU results must not depend on the number of threads a job gets (a run killed under one
# `snakemake --cores` and resumed under another trains the same weights): MKL's strict
# Conditional Numerical Reproducibility mode. Without it, where MKL takes its AVX2 path, its
# matrix products split by thread count (tests/test_train_draft.py). MKL reads it when torch
# loads it, so it is set here, before any stage imports torch; a value already set wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
