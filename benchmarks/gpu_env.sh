# Sourced from the repository root by the H200 scripts (h200_control/run.sh, pays.sh, h200_mtp/run.sh):
# installs the GPU bundle (.gpu_bundle/) and soakd's dependency wheels (.gpu_wheels/) into /tmp/site once
# per machine, and sets the environment soakd runs in there. Returns 1 when the install fails.
if [[ ! -d /tmp/site/vllm ]]; then
  mkdir -p /tmp/bundle && cp .gpu_bundle/* /tmp/bundle/ && (cd /tmp/bundle && bash install.sh) || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_wheels/*.whl || return 1
fi
export PYTHONPATH=/tmp/site:$PWD/daemon VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
# The sender's native stream reader (daemon/soakd/engine/_reader.c), built in place where a C compiler and
# Python's headers are; else one built for this Python elsewhere may be carried in; else soakd reads the
# streams in Python (engine.sender_reader = "auto").
if ! compgen -G "daemon/soakd/engine/_reader.cpython-*.so" > /dev/null && command -v cc > /dev/null; then
  cc -O2 -shared -fPIC -I"$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    daemon/soakd/engine/_reader.c \
    -o "daemon/soakd/engine/_reader$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" \
    2> /dev/null || true
fi
