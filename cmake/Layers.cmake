# The layers of src/ (src/LAYERS): each folder is a static library that links
# only the folders below it, and sees only their headers.
#
# A folder's headers are included as "<folder>/<file>.h" (e.g.
# "media/fault_medium.h"). src/ itself is on no include path: each library
# puts ${build}/layers/<folder> on its PUBLIC include path, a directory whose
# only entry is a link <folder> -> src/<folder>. So a file sees the headers of
# its own folder and of the folders it links, and an include of any other
# folder's header does not compile. include/ (the public API) is on every
# path; tools/check_layers.py checks which public headers each folder uses.
#
# nonstop_core is the whole engine, for programs, tests and tools.

set(NONSTOP_LAYERS "")
file(STRINGS ${PROJECT_SOURCE_DIR}/src/LAYERS _nonstop_layer_lines REGEX "^[a-z_]+:")
foreach(_line IN LISTS _nonstop_layer_lines)
  if(NOT _line MATCHES "^([a-z_]+):([^|]*)\\|")
    message(FATAL_ERROR "src/LAYERS: cannot read '${_line}' (folder: uses | headers)")
  endif()
  set(_name ${CMAKE_MATCH_1})
  string(STRIP "${CMAKE_MATCH_2}" _uses)
  separate_arguments(_uses UNIX_COMMAND "${_uses}")
  foreach(_dep IN LISTS _uses)
    if(NOT _dep IN_LIST NONSTOP_LAYERS)
      message(FATAL_ERROR "src/LAYERS: ${_name} uses ${_dep}, which is not on an earlier line")
    endif()
  endforeach()
  list(APPEND NONSTOP_LAYERS ${_name})
  set(NONSTOP_LAYER_USES_${_name} ${_uses})
endforeach()

add_library(nonstop_core INTERFACE)

# Puts folder `name`'s headers ("name/x.h") on `target`'s include path
# (`scope`: PUBLIC for its library, PRIVATE for an executable or module).
function(nonstop_layer_headers target scope name)
  set(dir ${PROJECT_BINARY_DIR}/layers/${name})
  if(NOT IS_SYMLINK ${dir}/${name})
    file(MAKE_DIRECTORY ${dir})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${name} ${dir}/${name} SYMBOLIC)
  endif()
  target_include_directories(${target} ${scope} ${PROJECT_SOURCE_DIR}/include ${dir})
endfunction()

# nonstop_library(<folder> <sources>...): the folder's library, nonstop_<folder>,
# linking what src/LAYERS says it uses; part of nonstop_core.
function(nonstop_library name)
  if(NOT name IN_LIST NONSTOP_LAYERS)
    message(FATAL_ERROR "src/${name} is not in src/LAYERS: add its line (what it uses) first")
  endif()
  add_library(nonstop_${name} STATIC ${ARGN})
  nonstop_layer_headers(nonstop_${name} PUBLIC ${name})
  foreach(dep IN LISTS NONSTOP_LAYER_USES_${name})
    target_link_libraries(nonstop_${name} PUBLIC nonstop_${dep})
  endforeach()
  target_link_libraries(nonstop_core INTERFACE nonstop_${name})
endfunction()

# The libraries a target in folder `name` links (python: the extension).
function(nonstop_link_layer target name)
  nonstop_layer_headers(${target} PRIVATE ${name})
  foreach(dep IN LISTS NONSTOP_LAYER_USES_${name})
    target_link_libraries(${target} PRIVATE nonstop_${dep})
  endforeach()
endfunction()
