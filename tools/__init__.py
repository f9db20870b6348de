"""Commands outside the pipeline: the tracking store's set-up (`make ui`), the comparison of reproduced
configurations (`make compare`), the fused kernel's build (`make`)."""
