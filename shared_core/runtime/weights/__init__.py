"""Where weights come from: the embedded offline models (`embedded`), name resolution and loading
(`sources`), the de-quantized GGUF cache (`dequant_cache`) and the shipped LoRA drafters (`lora`,
`lora_adapters/`)."""
