"""The data modules the recipes' configs name (``data._target_``): the digits, a folder of images, and the ``pinned``
recipe's rendered digits."""
