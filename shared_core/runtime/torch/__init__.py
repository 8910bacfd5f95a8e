"""The torch runtime: a KV session over a Hugging Face model (`session`), prefix reuse across calls
(`prefix`) and several rows at once (`batch`)."""
