"""What users run: ``python scripts/new_project.py`` (a recipe as a project of its own), ``python
scripts/digits_folder.py`` (the digits as a folder of image files), ``python -m scripts.copy_report`` (what a recipe's
training step copies)."""
