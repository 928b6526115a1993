"""The network: GPT (gpt.py), the chunked loss (loss.py), Hugging Face GPT-2 interop (hf.py), the BPE
tokenizer (tokenizer.py). Imports only gpt2.core."""
