"""moed inside other frameworks' models. Each submodule imports nothing of its framework until
it is used: ``moed.integrations.transformers`` (Hugging Face transformers' MoE models)."""
