"""Writing a plan into the model: the writer, lowest precedence first, with its undo and report
(``writer``), the tensors ``materialize`` keeps because the user loaded them (``kept``) and the one
progress bar (``progress``).
"""
