"""Stage 4, gradients: per-example LoRA gradients from hooks on the LoRA Linear layers (`capture`), the objectives
they differentiate (`objectives`, over the chunked `lm_head`), their flat `layout`, and forward-mode per-token
contributions along a direction (`tangents`)."""
