"""Model architectures, loaders (safetensors, GGUF) and tokenizers: torch, numpy and tokenizer libraries only."""
