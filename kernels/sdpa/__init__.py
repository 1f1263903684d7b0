"""`attention` on torch's own `scaled_dot_product_attention`: runs on every device, never builds fp32 S x S scores."""
