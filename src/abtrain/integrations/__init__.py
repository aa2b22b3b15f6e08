"""abtrain inside other training frameworks.

Each integration is its own module and imports its framework only when imported
itself: ``from abtrain.integrations.lightning import AbtrainStrategy`` needs the
``lightning`` extra (``pip install 'abtrain[lightning]'``); ``import abtrain`` never does.
"""
