from __future__ import annotations

import pytest

from packctl.errors import MissingExtraError, require


def test_missing_extra_names_the_install_line():
    with pytest.raises(MissingExtraError) as err:
        require("packctl_no_such_module.sub", "gpu", "flash-attn verification")
    assert str(err.value) == ("flash-attn verification needs the 'packctl_no_such_module' package, which is not "
                              "installed: pip install 'packctl[gpu]'")
    assert err.value.exit_code == 2


def test_present_module_is_returned():
    assert require("json", "dev", "x").dumps([1]) == "[1]"
