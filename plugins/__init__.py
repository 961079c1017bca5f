"""medfl's built-in plugins (installed as the ``medfl_plugins`` package).

Each module is registered through the ``medfl`` entry-point group, exactly as a
third-party plugin would be.
"""
