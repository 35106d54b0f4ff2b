"""LoRA adapters of the model store: read from their files in any format the base
family's diffusers loader reads (``lora_files``), and checked against the network
they adapt (``network_layers``)."""
