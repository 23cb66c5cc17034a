import pytest

# The scenarios' helpers assert too: show the compared values when one fails.
pytest.register_assert_rewrite("tests.gpu.mig_scenarios", "tests.gpu.node")
