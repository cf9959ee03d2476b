"""Appendix B · The Llama-style GPT every chapter trains, built from appendix A's layers."""
