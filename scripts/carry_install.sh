# Sourced by the gpu_*.sh installers (run THERE, on the lent GPU machine, from the repository
# root): where carried wheels are installed and how. Sets `site` (.carry/site, an ignored folder
# that lasts while the machine stays warm), `py` (PYTHON, default python3: the image's, which
# holds torch) and `pip_install` (offline, no dependency resolution, into $site; --upgrade so
# that a repeated part replaces its packages instead of skipping them with a warning).
site=.carry/site
py=${PYTHON:-python3}
pip_install=("$py" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --upgrade
             --target "$site")
