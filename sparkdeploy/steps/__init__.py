"""The pipeline's steps, each module or package named as its Prefect task."""
