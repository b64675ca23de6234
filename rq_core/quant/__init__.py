"""Weight quantization: recipes, tensor roles, the streaming quantizer."""
