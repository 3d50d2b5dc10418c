"""What vLLM takes (its argv) and what it prints (its log lines), as data."""
