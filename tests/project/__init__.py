"""The repository as a whole: runnable docs and examples, the import floors, module sizes."""
