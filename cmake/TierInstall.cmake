# Install headers, libraries and a CMake package so that other projects can find_package(tier).
include(CMakePackageConfigHelpers)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/tier DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS ${TIER_MODULE_TARGETS} tier EXPORT tierTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET tier-bench)
  install(TARGETS tier-bench RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  # `tier-bench summary --plot` runs this beside itself.
  install(PROGRAMS ${PROJECT_SOURCE_DIR}/apps/tier-bench/tier-bench-plot DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(EXPORT tierTargets NAMESPACE tier:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tier)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/tierConfig.cmake.in
  ${PROJECT_BINARY_DIR}/tierConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tier)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/tierConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/tierConfig.cmake ${PROJECT_BINARY_DIR}/tierConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tier)
