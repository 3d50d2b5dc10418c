"""The pipeline's steps, each module named as its Prefect task."""
