# Run by `cmake --install` (install(CODE) in CMakeLists.txt sets _sgm_python,
# _sgm_package, _sgm_libdir, _sgm_soname): copies python/sgm into the
# site-packages of the interpreter for the install prefix (python/install_dir.py
# says which folder) and writes sgm/_install.py with the path of the installed
# libsgm.so relative to the package, so the installed tree stays relocatable.
if(NOT _sgm_python)
  message(STATUS "sgm: no python3 found at configure time: the Python package is not installed "
                 "(set SGM_PYTHON)")
  return()
endif()
execute_process(COMMAND "${_sgm_python}" "${_sgm_package}/../install_dir.py" "${CMAKE_INSTALL_PREFIX}"
  OUTPUT_VARIABLE _sgm_out RESULT_VARIABLE _sgm_rc OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _sgm_rc EQUAL 0)
  message(FATAL_ERROR "sgm: ${_sgm_python} python/install_dir.py failed (${_sgm_rc})")
endif()
string(REPLACE "\n" ";" _sgm_out "${_sgm_out}")
list(GET _sgm_out 0 _sgm_site)
list(GET _sgm_out 1 _sgm_where)
file(INSTALL DESTINATION "${_sgm_site}" TYPE DIRECTORY FILES "${_sgm_package}"
  FILES_MATCHING PATTERN "*.py" PATTERN "__pycache__" EXCLUDE)
if(IS_ABSOLUTE "${_sgm_libdir}")
  set(_sgm_lib "${_sgm_libdir}/${_sgm_soname}")
else()
  set(_sgm_lib "${CMAKE_INSTALL_PREFIX}/${_sgm_libdir}/${_sgm_soname}")
endif()
file(RELATIVE_PATH _sgm_rel "${_sgm_site}/sgm" "${_sgm_lib}")
set(_sgm_stamp "$ENV{DESTDIR}${_sgm_site}/sgm/_install.py")
message(STATUS "Installing: ${_sgm_stamp}")
file(WRITE "${_sgm_stamp}"
  "\"\"\"Written by cmake --install: libsgm.so relative to this package's folder.\"\"\"\n"
  "LIBRARY = \"${_sgm_rel}\"\n")
list(APPEND CMAKE_INSTALL_MANIFEST_FILES "${_sgm_site}/sgm/_install.py")
if(_sgm_where STREQUAL "needs-pythonpath")
  message(STATUS "sgm: the Python package is in ${_sgm_site}, which ${_sgm_python} does not "
                 "search: set PYTHONPATH=${_sgm_site} to import sgm")
endif()
