# Installing stoke (GNUInstallDirs): the CLI, the module libraries and their headers under
# include/stoke/<module>/, the CMake package (find_package(stoke)), a pkg-config file, the docs
# and example configs, the Python package when it is built; and CPack's Debian package.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(STOKE_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/stoke)
# The modules a program can use: find_package(stoke COMPONENTS ...) and stoke::<module>.
set(STOKE_MODULES common dataset decode augment prefetch dist train pack inspect)
set(_stoke_module_dirs common dataset decode augment prefetch dist train tools/pack tools/inspect)

set_target_properties(stoke_compile_options PROPERTIES EXPORT_NAME compile_options)
foreach(module IN LISTS STOKE_MODULES)
  set_target_properties(stoke_${module} PROPERTIES EXPORT_NAME ${module})
  list(APPEND _stoke_module_targets stoke_${module})
endforeach()
install(TARGETS stoke_compile_options ${_stoke_module_targets} EXPORT stokeTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
install(TARGETS stoke RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)

# Headers keep their paths relative to the source root: #include "prefetch/loader.h".
foreach(dir IN LISTS _stoke_module_dirs)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${dir}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/stoke/${dir}
          COMPONENT dev FILES_MATCHING PATTERN "*.h")
endforeach()

install(EXPORT stokeTargets NAMESPACE stoke:: DESTINATION ${STOKE_INSTALL_CMAKEDIR} COMPONENT dev)
string(REPLACE ";" ", " STOKE_MODULES_LIST "${STOKE_MODULES}")
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/stokeConfig.cmake.in
  ${PROJECT_BINARY_DIR}/stokeConfig.cmake INSTALL_DESTINATION ${STOKE_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so 0.3 accepts 0.3.*, not 0.4.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/stokeConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/stokeConfig.cmake ${PROJECT_BINARY_DIR}/stokeConfigVersion.cmake
        DESTINATION ${STOKE_INSTALL_CMAKEDIR} COMPONENT dev)

# pkg-config, for programs built without CMake (static libraries: pkg-config --static).
set(STOKE_PC_LIBS "-lstoke_train -lstoke_pack -lstoke_inspect -lstoke_prefetch -lstoke_dist -lstoke_augment -lstoke_decode -lstoke_dataset -lstoke_common")
set(STOKE_PC_LIBS_PRIVATE "-ldnnl -fopenmp -lpthread")
if(STOKE_WITH_CUDA)
  string(APPEND STOKE_PC_LIBS_PRIVATE " -L${CUDAToolkit_LIBRARY_DIR} -lcudart -lcublas -lcudnn")
endif()
set(STOKE_PC_REQUIRES_PRIVATE "lmdb libturbojpeg libjpeg opencv4 tbb fmt spdlog nlohmann_json yaml-cpp")
if(STOKE_WITH_MPI)
  string(APPEND STOKE_PC_REQUIRES_PRIVATE " ompi-c")
endif()
if(STOKE_WITH_TENSORBOARD)
  string(APPEND STOKE_PC_REQUIRES_PRIVATE " protobuf-lite")
endif()
set(STOKE_PC_WITH_CUDA 0)
set(STOKE_PC_WITH_MPI 0)
if(STOKE_WITH_CUDA)
  set(STOKE_PC_WITH_CUDA 1)
endif()
if(STOKE_WITH_MPI)
  set(STOKE_PC_WITH_MPI 1)
endif()
# The prefix relative to the .pc file, so that an installed tree can move (cmake --install --prefix).
file(RELATIVE_PATH STOKE_PC_UP ${CMAKE_INSTALL_FULL_LIBDIR}/pkgconfig ${CMAKE_INSTALL_PREFIX})
configure_file(${PROJECT_SOURCE_DIR}/cmake/stoke.pc.in ${PROJECT_BINARY_DIR}/stoke.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/stoke.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)

install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT runtime)
# Beside the README as in the source tree (docs/...), so that its links lead somewhere.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR}/docs COMPONENT runtime)
install(FILES ${PROJECT_SOURCE_DIR}/bench/RESULTS.md DESTINATION ${CMAKE_INSTALL_DOCDIR}/bench COMPONENT runtime)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/configs/ DESTINATION ${CMAKE_INSTALL_DATADIR}/stoke/configs
        COMPONENT runtime)

# The Debian package: `cpack -G DEB` in the build tree. Its dependencies are Debian 12's runtime
# packages of what stoke links.
set(CPACK_PACKAGE_NAME stoke)
set(CPACK_PACKAGE_VENDOR "stoke")
set(CPACK_PACKAGE_CONTACT "stoke maintainers <stoke@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "pack image datasets into LMDB and feed them to GPUs fast")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_STRIP_FILES ON)
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEB_COMPONENT_INSTALL OFF)
set(_stoke_deb_depends
  "liblmdb0" "libturbojpeg0" "libjpeg62-turbo" "libopencv-core406" "libopencv-imgproc406"
  "libopencv-imgcodecs406" "libtbb12" "libspdlog1.10" "libfmt9" "libyaml-cpp0.7" "libdnnl2"
  "libgomp1" "libstdc++6" "libc6")
if(STOKE_WITH_MPI)
  list(APPEND _stoke_deb_depends "libopenmpi3")
endif()
if(STOKE_WITH_ONNX)
  list(APPEND _stoke_deb_depends "libonnx1" "libprotobuf32")  # stoke export
endif()
if(STOKE_WITH_TENSORBOARD)
  list(APPEND _stoke_deb_depends "libprotobuf-lite32")  # TensorBoard event files
endif()
if(STOKE_WITH_MONITOR)
  list(APPEND _stoke_deb_depends "libcpp-httplib0.11")  # stoke monitor
endif()
list(JOIN _stoke_deb_depends ", " CPACK_DEBIAN_PACKAGE_DEPENDS)
if(STOKE_WITH_CUDA)
  # The CUDA runtime, cuBLAS and cuDNN are NVIDIA's (not Debian packages): the GPU machine has them.
  set(CPACK_DEBIAN_PACKAGE_DESCRIPTION "Built with the CUDA backend: needs the CUDA runtime, cuBLAS and cuDNN 9 from NVIDIA at run time.")
endif()
include(CPack)
