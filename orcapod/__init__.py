"""The ``orcapod`` command: a launcher over the actor packages."""
